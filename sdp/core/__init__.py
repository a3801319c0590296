"""The bottom layer: what every package of ``sdp`` may use and which imports nothing above it
(:mod:`sdp.core.fields`: how a typed config key is declared and checked, so a strategy in ``sdp/parallel``
declares its own schema without importing the driver)."""
