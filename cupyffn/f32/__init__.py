"""The GPU engine: a plan (what runs), its scratch layout, its launches, the stage schedule and the engine state."""
