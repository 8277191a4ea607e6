"""End to end: the jail of untrusted jobs (attacks), required jail layers, the zygote, weight integrity, deadlines."""
