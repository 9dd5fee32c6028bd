"""Hooks through which serving engines discover prefill-accel; each is inert where its engine is absent."""
