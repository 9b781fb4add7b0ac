"""`python -m turnkv`: the `turnkv` command."""

import sys

from turnkv.cli import main

sys.exit(main())
