"""Where the tests find the offline data, tokenizers and models a development checkout has beside it.

One root, ``$CTA_SHARED_DIR`` (default ``../shared`` next to the repository), read through the example scripts' own
:func:`common.shared_dir`. A user's clone has nothing there: every test that needs one of these paths skips with its
reason or builds what it needs itself. ``CTA_SHARED_DIR=/an/empty/folder python -m pytest ...`` runs as such a clone
(CI does, for the test files that read these paths).
"""

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "examples") not in sys.path:
    sys.path.insert(0, str(REPO / "examples"))

import common  # noqa: E402

SHARED = Path(common.shared_dir())
# stories260K ships with the repository (examples/demo_data, the same files as $CTA_SHARED_DIR/models/stories260K):
# the tests that use it run on a bare clone too. CTA_STORIES260K, where set, points elsewhere.
STORIES260K = Path(os.environ.get("CTA_STORIES260K") or REPO / "examples" / "demo_data" / "stories260K")
BERT_TOKENIZER = Path(os.environ.get("CTA_PAPER_TOKENIZER") or
                      os.path.join(common.default_tokenizer_dir(), common.PAPER_TOKENIZER))

