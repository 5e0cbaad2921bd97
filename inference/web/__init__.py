"""The browser server's parts: the wire protocol, the scheduler that steps every player's session
in one batched call, and the web app (``python -m inference.serve``)."""
