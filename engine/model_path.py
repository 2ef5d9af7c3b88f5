"""The one resolver of a ``--model`` value to a local Hugging Face directory.

Shared by the engine's loader and the router's tokenizer; imports no torch. Nothing is ever
downloaded: ``demo`` is the bundled model, anything else must be a local directory.
"""

from __future__ import annotations

from pathlib import Path


def resolve_model_path(model: str) -> Path:
    """'demo' is the bundled demo model; anything else must be a directory with config.json.

    Raises ValueError (the demo's own DemoWeightsMissingError, a FileNotFoundError, when its
    files are missing) naming what is wrong.
    """
    if model == "demo":
        from tandem.engine.demo import weights_path

        return weights_path()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r} is not 'demo' or a local directory with config.json "
            "(nothing is downloaded at run time)"
        )
    return path
