"""Lightning's scenarios, run one after the other in one process (per rank).

    python lightning_scenarios.py OUT RUN DEVICES SCENARIO [SCENARIO ...]

SCENARIO is a Trainer scenario of ``lightning_trainer.py`` (``before-fit``, ``module``,
``pipeline``) or a Fabric one of ``fabric_loop.py`` (``fabric``, ``fabric-sampler``,
``fabric-pipeline``); each writes its steps and checkpoints
to ``OUT/<scenario>/``. They share what costs the most here: starting Python and
importing Lightning, and on 2 devices the DDP process group, which the first scenario
creates (Lightning starts rank 1, which runs this script with the same arguments) and
the later ones find in place, as a script that fits twice does. ``before-fit`` must
therefore come first: its loader is built before the process group exists.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fabric_loop
import lightning_trainer

OUT, RUN, DEVICES, SCENARIOS = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]
if "before-fit" in SCENARIOS[1:]:
    raise ValueError(f"'before-fit' must be the first scenario (built before the process group), got {SCENARIOS}")
for scenario in SCENARIOS:
    out = OUT / scenario
    out.mkdir(exist_ok=True)
    if scenario in fabric_loop.HOWS:
        fabric_loop.run(out, RUN, DEVICES, scenario)
    else:
        lightning_trainer.run(out, RUN, DEVICES, scenario)
