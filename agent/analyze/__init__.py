"""``rankwatch analyze``: the live detectors over a recorded job."""
