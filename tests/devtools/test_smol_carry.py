"""devtools.smol_carry (issue #69 item 4): the GGUF split into two carry folders under the size a call carries, with a
manifest of sha256s; reassembled and verified where the learning harness finds it; a missing or corrupt piece refused,
naming it and what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from devtools import smol_carry as sc


@pytest.fixture
def carried(tmp_path):
    gguf = tmp_path / "Tiny.Q4_1.gguf"
    gguf.write_bytes(os.urandom(3 * 2**20 + 7))  # an odd size: the two pieces differ by one byte
    wheel = tmp_path / "gguf-0.19.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gguf/__init__.py", "MARK = 'carried gguf'\n")
        z.writestr("gguf-0.19.0.dist-info/METADATA", "Name: gguf\nVersion: 0.19.0\n")
    carry = tmp_path / "carry"
    manifest = sc.split(gguf, [wheel], carry, folder_bytes=2 * 2**20 + 2**19)
    return gguf, carry, manifest


def test_split_two_folders_with_a_manifest_each(carried):
    gguf, carry, m = carried
    assert [p["folder"] for p in m["pieces"]] == ["1", "2"] and m["wheels"][0]["folder"] == "2"
    assert sum(p["bytes"] for p in m["pieces"]) == gguf.stat().st_size == m["gguf"]["bytes"]
    assert m["gguf"]["sha256"] == sc.sha256(gguf) and m["pins"] == sc.PINS
    for n in ("1", "2"):
        assert json.loads((carry / n / sc.MANIFEST).read_text()) == m
    assert sc.check("1", carry) == [m["pieces"][0]["file"]]
    assert sc.check("2", carry) == [m["pieces"][1]["file"], m["wheels"][0]["file"]]
    with pytest.raises(sc.CarryError, match="over the"):
        sc.split(gguf, [], carry, folder_bytes=2**20)


def test_assemble_rebuilds_the_gguf_where_the_harness_finds_it(carried, tmp_path):
    gguf, carry, m = carried
    site = sc.assemble(carry)
    target = site / sc.PACKAGE / gguf.name
    assert target.read_bytes() == gguf.read_bytes() and (site / "gguf" / "__init__.py").exists()
    assert sc.assemble(carry) == site  # done already: nothing again
    code = ("from research.common import smollm2_path; import gguf; d, g = smollm2_path(); print(d, g, gguf.MARK)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(sc.ROOT), str(site)])}).stdout
    assert out.split()[:2] == [str(target.parent), gguf.name]


def test_missing_or_corrupt_pieces_are_refused(carried):
    gguf, carry, m = carried
    first = carry / "1" / m["pieces"][0]["file"]
    data = first.read_bytes()
    first.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(sc.CarryError, match="corrupt piece: .smol_carry/1/"):
        sc.assemble(carry)
    first.unlink()
    with pytest.raises(sc.CarryError, match="missing piece.*went cold after call 1: run call 1 again"):
        sc.assemble(carry)
    assert not (carry / sc.SITE_NAME / sc.PACKAGE / gguf.name).exists()
