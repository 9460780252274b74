"""`python -m dsv41_jax.cli.main` = the `dsv41` command."""
import sys

from dsv41_jax.cli.main import main

sys.exit(main())
