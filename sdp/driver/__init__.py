"""The driver: what runs once per job before any rank starts (the typed config schema, its parse and checks)."""
