"""The one ``graphattn`` logger (NullHandler: silent unless the application configures logging)."""

from __future__ import annotations

import logging

logger = logging.getLogger("graphattn")
logger.addHandler(logging.NullHandler())
