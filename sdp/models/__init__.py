"""Models: every model is an :class:`sdp.models.base.SDPModel` (stem -> blocks -> head)."""
