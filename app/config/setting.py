"""A setting as data: its name, default, help and group, and how a raw value becomes its type."""

from __future__ import annotations

from typing import Any, NamedTuple

ENV_PREFIX = "RANKWATCH_"
BOOLEANS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


# Settings for which 0 means something (pick a port; retention milestones off).
ZERO_OK = ("PORT", "RETENTION_EVERY", "SKIP_BATCHES", "MAX_ROLLBACKS")


# The settings' groups (``Setting.group``).
G_RUN = "Run directory and address"
G_HEALTH = "Health verdicts"
G_PAGE = "Page, charts and metrics"
G_STOP = "Stop and checkpoints"
G_ACCESS = "Access"
G_INCIDENTS = "Stacks, alerts and the stop policy"
G_SERVER = "Server"
G_REDIS = "Several dashboards (Redis)"
G_AGENTS = "Agents (Redis)"

# How ``rankwatch serve --help`` groups the settings, in this order; a setting
# not listed here is shown under "Other settings".
# The groups `rankwatch serve --help` and docs/reference.md list the settings in, in this order.
GROUPS: tuple[str, ...] = (
    G_RUN,
    G_HEALTH,
    G_PAGE,
    G_STOP,
    G_ACCESS,
    G_INCIDENTS,
    G_SERVER,
    G_REDIS,
    G_AGENTS,
)


class Setting(NamedTuple):
    name: str
    default: Any
    help: str
    # The only values a string setting takes, when it is one of a few words.
    choices: tuple[str, ...] = ()
    # Where ``serve --help`` and the reference list it (one of ``GROUPS``).
    group: str = ""
    # False for a secret: no command-line flag (every user of the host reads argv in ``ps``),
    # only ``RANKWATCH_<NAME>`` or a file named by ``RANKWATCH_<NAME>_FILE``.
    argv: bool = True

    @property
    def env_file(self) -> str:
        return self.env + "_FILE"

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name

    @property
    def flag(self) -> str:
        return "--" + self.name.lower().replace("_", "-")

    def coerce(self, value: Any) -> Any:
        """Convert ``value`` (often a string from the environment) to this setting's type.

        Raises ValueError naming the setting, so a typo in an environment
        variable fails at start with a message that says which one.
        """
        kind = type(self.default)
        if self.choices:
            if str(value).strip() not in self.choices:
                raise ValueError(
                    f"setting {self.name} ({self.env}) must be one of {', '.join(self.choices)}, not {value!r}"
                )
            return str(value).strip()
        if kind is bool and isinstance(value, str):
            if value.strip().lower() not in BOOLEANS:
                raise ValueError(
                    f"setting {self.name} ({self.env}) must be one of {', '.join(BOOLEANS)}, not {value!r}"
                )
            return BOOLEANS[value.strip().lower()]
        try:
            typed = kind(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"setting {self.name} ({self.env}) must be {kind.__name__}, not {value!r}"
            ) from None
        if kind in (int, float) and self.name not in ZERO_OK and typed <= 0:
            raise ValueError(f"setting {self.name} ({self.env}) must be positive, not {typed}")
        return typed
