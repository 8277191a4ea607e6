"""End to end: one model shared by many clients: fair turns, co-batches, load, capacity, queue places."""
