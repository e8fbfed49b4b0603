"""megatron-core releases: what differs is detected in mcore_versions.py, and a checkpoint
written under one supported release resumes exactly under another.

The cross-release test runs when MEGATRON_WEIPIPE_OTHER_PYTHON names a Python whose
megatron-core differs from this one (tools/test_newest_mcore.sh sets it to the main
environment's Python); elsewhere it is skipped, saying so.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from harness.runs import REPO_ROOT, tiny_gpt_args

from megatron_weipipe import mcore_versions

OTHER_PYTHON = os.environ.get("MEGATRON_WEIPIPE_OTHER_PYTHON")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO_ROOT, os.path.join(REPO_ROOT, "tests")]))
# Train on two ranks and print losses as exact float reprs (distributed optimizer, dropout on).
DRIVER = """
import json, sys
from harness import run_distributed
from harness.runs import train_and_collect
argv = json.loads(sys.argv[1])
out = run_distributed(train_and_collect, 2, argv, False, timeout=300)
import megatron.core
print(json.dumps({"losses": [float(x) for x in out[-1]["losses"]], "iteration": out[-1]["iteration"],
                  "mcore": megatron.core.__version__}))
"""


def test_features_are_detected_for_the_installed_release():
    from megatron.core import dist_checkpointing
    import inspect

    takes = "common_strategy" in inspect.signature(dist_checkpointing.load).parameters
    assert mcore_versions.load_takes_common_strategy() is takes
    assert (mcore_versions.common_state_loader_owner() is None) is takes
    assert mcore_versions.version().split(".")[:2] in [v.split(".") for v in mcore_versions.SUPPORTED]


def test_tokenizers_derive_from_the_releases_base_and_build():
    from megatron_weipipe.data.tokenizers import ByteLevelTokenizer

    tok = ByteLevelTokenizer()
    assert isinstance(tok, mcore_versions.tokenizer_base())
    assert tok.detokenize(tok.tokenize("héllo")) == "héllo"


def _train(python, argv):
    out = subprocess.run([python, "-c", DRIVER, json.dumps(argv)], env=ENV, capture_output=True, text=True,
                         timeout=360, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not OTHER_PYTHON, reason="MEGATRON_WEIPIPE_OTHER_PYTHON is not set (tools/test_newest_mcore.sh sets it)")
def test_checkpoints_resume_exactly_across_releases(tmp_path):
    common = dict(train_iters=4, hidden_dropout=0.1, use_distributed_optimizer=True, lr_warmup_iters=1)
    pythons = {"this": sys.executable, "other": OTHER_PYTHON}
    straight = {name: _train(py, tiny_gpt_args(**common)) for name, py in pythons.items()}
    assert straight["this"]["mcore"] != straight["other"]["mcore"], "both Pythons have the same megatron-core"
    for saver, loader in (("other", "this"), ("this", "other")):
        ckpt = str(tmp_path / f"{saver}-to-{loader}")
        first = _train(pythons[saver], tiny_gpt_args(**common, save=ckpt, save_interval=2, exit_interval=2))
        second = _train(pythons[loader], tiny_gpt_args(**common, save=ckpt, load=ckpt, save_interval=2))
        assert first["iteration"] == 2 and second["iteration"] == 4
        # Same torch on both sides: the resumed half equals the loader's uninterrupted run.
        np.testing.assert_allclose(first["losses"] + second["losses"], straight[loader]["losses"], rtol=1e-6,
                                   err_msg=f"saved under megatron-core {straight[saver]['mcore']}, "
                                           f"loaded under {straight[loader]['mcore']}")
