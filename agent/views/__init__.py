"""What an agent shows: its Status answer and the summary it sends its coordinator."""
