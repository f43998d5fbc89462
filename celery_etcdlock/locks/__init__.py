"""The primitives (mutex, RW lock, semaphore, election, store), the fair queue under them, and
the session that owns each process's lease. Nothing in this folder imports Celery."""
