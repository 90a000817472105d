"""Tests of actcache.loaders, one file per module (a package, so that names such as
test_plan.py do not clash with tests of other packages)."""
