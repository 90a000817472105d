"""`python -m actcache.cli ...` (torchrun starts ranks this way)."""

import sys

from actcache.cli import main

sys.exit(main())
