"""torchrun's rendezvous backend ``rankwatch``: the stock dynamic rendezvous, plus exclusions.

torchrun finds ``entry.handler_factory`` (``rankwatch``, on c10d) and
``entry.etcd_handler_factory`` (``rankwatch-etcd``) through the ``torchrun.handlers`` entry point. The handler is in
``handler``; the exclusions it reads in ``exclusions``; the exit barrier's stand-in in
``exit_barrier``; the thread that relays the node's decisions in ``poller``; the in-process
recovery's keys of a round in ``round_keys``; every use of the stock handler's private API in
``stock``; the note to ``rankwatch run`` of a refused node in ``exit_note``; a lost node's
early exit from the rendezvous, on proof, in ``lifeline``.
"""

# Nothing is imported here: torch's rendezvous registry loads the entry points while
# ``handler`` itself is being imported, so a re-export here would be a cycle.
