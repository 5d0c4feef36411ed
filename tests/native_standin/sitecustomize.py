"""Loaded by the embedded interpreter of a tritonserver the native-route test starts (this folder is first on its
PYTHONPATH): the test's stand-in engine, only inside tritonserver and only when the test asks for it."""

import os

if os.environ.get("KKDEPLOY_NATIVE_STANDIN") and os.path.basename(os.readlink("/proc/self/exe")) == "tritonserver":
    import kk_native_standin

    kk_native_standin.install()
