"""A child for tests/test_proof_process.py: asks to die with its parent, as the proof and probe children do, says
so, and sleeps."""

import time

from kkdeploy.processes import die_with_parent

if __name__ == "__main__":
    die_with_parent()
    print("sleeping", flush=True)
    time.sleep(600)
