"""pytest set-up shared by all test modules.

The shared helper modules assert too: have pytest rewrite their asserts, so that they
check (and explain) under ``python -O`` as well, which CI uses for part of the suite.
"""

import pytest

pytest.register_assert_rewrite("tests.common", "tests.wrapper_common", "tests.dist_harness")
