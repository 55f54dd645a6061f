"""What every rank imports at run time, in three subpackages, imports pointing down: requests/ (a request,
a job and their checks) <- http/ (the server on rank 0) <- engine/ (the ranks: loop, batches, outputs)."""
