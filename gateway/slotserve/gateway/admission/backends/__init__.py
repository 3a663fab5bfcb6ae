"""The admission backends: one in-process, one shared by every replica through Redis."""
