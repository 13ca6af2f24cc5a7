"""A clone stands on its own: no file of the project reads or names a folder beside the repository (the dev machines
have one, a user's clone does not). The OpenAI spec the gateway tests validate against lives in tests/http_gateway."""

from __future__ import annotations

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUTSIDE = "../" + "shared"  # spelled in two parts so this file does not match itself


def _tracked_files() -> list[pathlib.Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_no_file_names_a_folder_beside_the_repository():
    files = _tracked_files()
    assert len(files) > 100, "git ls-files listed the project"
    offenders = [
        str(p.relative_to(ROOT)) for p in files if p.is_file() and OUTSIDE.encode() in p.read_bytes()
    ]
    assert offenders == []


def test_the_openai_spec_is_in_the_repository_with_its_notice():
    spec = ROOT / "tests" / "http_gateway" / "openai-openapi.yaml"
    notice = spec.with_suffix(".NOTICE")
    assert spec.stat().st_size > 1_000_000 and spec.read_text().lstrip().startswith("#")
    assert "MIT" in notice.read_text() and "openai/openai-openapi" in notice.read_text()
