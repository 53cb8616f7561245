"""pytest set-up shared by all test modules.

The shared helper modules assert too: have pytest rewrite their asserts, so that they
check (and explain) under ``python -O`` as well, which CI uses for part of the suite.

gcsfs >= 2025.10 chooses, when it is first imported, whether to ask a gRPC control API
(which no emulator has) for each bucket's layout; once it has chosen to, every request to
the GCS emulator hangs. Any test module may import gcsfs first (through fsspec), so the
choice is made off here, before any of them, for the whole session and the processes it
starts (``storage_servers.GCS_ENV``).
"""

import os

import pytest

from tests.storage_servers import GCS_ENV

for _name, _value in GCS_ENV.items():
    os.environ.setdefault(_name, _value)

pytest.register_assert_rewrite("tests.common", "tests.wrapper_common", "tests.dist_harness")
