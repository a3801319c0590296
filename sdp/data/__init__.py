"""Datasets: each module's ``build(**dataset_cfg)`` returns a :class:`sdp.data.base.DataBundle`."""
