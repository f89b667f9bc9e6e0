"""A node agent's link to its job: the coordinator it syncs with (``uplink``), how it is chosen
(``election``), and what the agent knows of the job (``known``)."""
