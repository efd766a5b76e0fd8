"""Profile -> files: the SGLang-compatible cost table JSON named after the device SKU, with
the profile's metadata, and the SPS(B) / tokens/s(B) PNG next to it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark_serve.profiling.sps import SpsProfile, cost_table_from_profile


def write_profile(profile: SpsProfile, out_dir: str | Path, *, meta: dict[str, Any],
                  context_len: int | None = None, max_batch_tokens: int | None = None,
                  plot: bool = True) -> tuple[Path, Path | None]:
    """Write ``{sku}.json`` (``CostTable``, loadable by ``dspark-serve serve --cost-table`` and
    SGLang's ``--speculative-dspark-sps-table-path``) and, if ``plot``, ``{sku}.png`` into
    ``out_dir``; ``meta["sku"]`` names them. Returns (json path, png path or None).

    Raises ValueError if ``meta`` has no ``sku``, plus ``cost_table_from_profile``'s errors.
    """
    sku = meta.get("sku")
    if not sku:
        raise ValueError("meta must carry the device 'sku' that names the files")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = cost_table_from_profile(profile, context_len=context_len,
                                    max_batch_tokens=max_batch_tokens, meta=meta)
    json_path = out_dir / f"{sku}.json"
    table.save(json_path)
    png_path = None
    if plot:
        from dspark_serve.profiler.plot import plot_profile  # matplotlib only when a figure is wanted
        title = f"{sku}" + (f" - {meta['model']}" if meta.get("model") else "")
        png_path = plot_profile(profile, out_dir / f"{sku}.png", title=title)
    return json_path, png_path
