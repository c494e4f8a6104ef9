"""ddiloco.core: what every ddiloco part shares and nothing else.

Typed configuration (``config``: strict config dataclasses, the config document and its
sections), the mode presets (``modes``), structured logs (``logs``) and the ``ddiloco`` command
(``cli``), which finds the sub-commands of whichever ddiloco parts are installed.
"""

__version__ = "0.1.0"
