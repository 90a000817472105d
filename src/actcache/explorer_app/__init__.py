"""The explorer's browser app (index.html, app.js, app.css): static files, the same for every SAE,
copied next to a run's explorer data (docs/explorer-format.md). Plain JavaScript, no build step and
no network: it loads ``data/*.js`` chunks by inserting script elements, so it opens from file://."""

from __future__ import annotations

import os
import shutil

APP_DIR = os.path.dirname(os.path.abspath(__file__))
APP_FILES = ("index.html", "app.js", "app.css")


def copy_app(dest: str) -> list[str]:
    """Copy the app's files into ``dest`` (created when missing); returns the paths written."""
    os.makedirs(dest, exist_ok=True)
    out = []
    for name in APP_FILES:
        out.append(os.path.join(dest, name))
        shutil.copyfile(os.path.join(APP_DIR, name), out[-1])
    return out
