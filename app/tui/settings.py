"""The user's TUI settings in one JSON file: default model, theme, thinking, sampling presets,
per-model system prompt and preset, and the embedded server's address and API key.

`default_model()` is what `ninfer chat` / `ninfer run` use when no MODEL is given (the model
wizard's "set default" writes it).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer_core.errors import NinferError

from .paths import settings_path

# Sampling presets: SamplingParams fields; "default" leaves everything to the model's generation_config.
BUILTIN_PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "precise": {"temperature": 0.0},
    "balanced": {"temperature": 0.7, "top_p": 0.8, "top_k": 20},
    "creative": {"temperature": 1.0, "top_p": 0.95, "top_k": 40},
}

if TYPE_CHECKING:
    from ninfer_core.engine.sampling import SamplingParams


@dataclass
class ModelPrefs:
    system: str = ""
    preset: str = "default"


@dataclass
class ServerPrefs:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str = ""  # made on first start, then kept so editor configs stay valid


@dataclass
class Settings:
    default_model: str | None = None
    theme: str = "ninfer"
    thinking: bool = True
    presets: dict[str, dict[str, Any]] = field(default_factory=dict)  # the user's, over the built-ins
    models: dict[str, ModelPrefs] = field(default_factory=dict)
    server: ServerPrefs = field(default_factory=ServerPrefs)
    path: Path | None = field(default=None, repr=False, compare=False)

    # -- file -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path | None = None) -> Settings:
        path = path or settings_path()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls(path=path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise NinferError(f"{path}: unreadable settings ({e}); fix or delete the file") from None
        try:
            settings = cls(
                default_model=data.get("default_model"),
                theme=data.get("theme", "ninfer"),
                thinking=bool(data.get("thinking", True)),
                presets=dict(data.get("presets", {})),
                models={name: ModelPrefs(**prefs) for name, prefs in data.get("models", {}).items()},
                server=ServerPrefs(**data.get("server", {})),
                path=path,
            )
        except (TypeError, AttributeError) as e:
            raise NinferError(f"{path}: unexpected settings entry ({e}); fix or delete the file") from None
        for name in settings.presets:
            settings.sampling_for_preset(name)  # unknown fields or bad values: named now, not mid-chat
        return settings

    def save(self) -> None:
        path = self.path or settings_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = asdict(self)
        data.pop("path")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    # -- presets ----------------------------------------------------------------------------

    def preset_names(self) -> list[str]:
        return list(dict.fromkeys([*BUILTIN_PRESETS, *self.presets]))

    def sampling_for_preset(self, name: str) -> SamplingParams:
        from ninfer_core.engine.sampling import SamplingParams  # torch: not for `ninfer --help`

        values = self.presets.get(name, BUILTIN_PRESETS.get(name))
        if values is None:
            raise NinferError(f"no sampling preset '{name}' (choose from: {', '.join(self.preset_names())})")
        unknown = set(values) - {f.name for f in fields(SamplingParams)}
        if unknown:
            raise NinferError(f"{self.path}: preset '{name}' has unknown field(s) {', '.join(sorted(unknown))}")
        return SamplingParams(**values)

    # -- per model --------------------------------------------------------------------------

    def prefs(self, model: str) -> ModelPrefs:
        return self.models.setdefault(model, ModelPrefs())

    def sampling(self, model: str) -> SamplingParams:
        return self.sampling_for_preset(self.prefs(model).preset)

    def server_api_key(self) -> str:
        if not self.server.api_key:
            self.server.api_key = "sk-ninfer-" + secrets.token_urlsafe(18)
            self.save()
        return self.server.api_key


def default_model() -> str | None:
    """The model set as default in the wizard (None: the embedded default model)."""
    return Settings.load().default_model
