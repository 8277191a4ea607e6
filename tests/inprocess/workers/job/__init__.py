"""In-process tests of workers/job/: a job's steps, its deadline, co-batch gathering."""
