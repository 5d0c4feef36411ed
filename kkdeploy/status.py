"""Candidate status values: what a manifest, a validation report and the chooser say of each candidate.

They live on the ground floor because every floor above speaks them: a builder records ``built`` or
``unavailable`` (``engines``), the validator turns ``built`` into ``passed`` or ``failed`` (``validation``), and the
chooser and ``kkdeploy.load`` read them back (``kkdeploy.pipeline``). The strings are the manifest format.
"""

# what a builder records
BUILT, UNAVAILABLE, BUILD_FAILED, SKIPPED = "built", "unavailable", "build-failed", "skipped"
# what validation records
UNVALIDATED, PASSED, FAILED = "unvalidated", "passed", "failed"
PASSED_ALL_VALID_ONLY = "passed-all-valid-only"  # serves all-valid calls; padded ones go elsewhere
