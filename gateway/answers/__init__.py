"""What the gateway changes in a replica's answer on its way to the client, and how a whole answer
is assembled from a stream (see events.py for the shapes every change works on)."""
