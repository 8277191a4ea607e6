"""In-process tests of workers/isolation/: the zygote and shared weights."""
