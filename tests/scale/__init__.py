"""Scale-out: workers sharing an example database."""
