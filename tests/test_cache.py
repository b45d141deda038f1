"""Caches by content hash: every kind of damage is detected and recomputed, never used."""

import numpy as np

from qgate.cache import read_cached, read_cached_arrays, write_cached


def test_cache_roundtrip_and_every_kind_of_damage(tmp_path, capsys):
    path = tmp_path / "c" / "x.json"
    write_cached(path, b'{"a": 1}')
    assert read_cached(path) == b'{"a": 1}'
    path.write_bytes(b'{"a": 1')  # truncated
    assert read_cached(path) is None and not path.exists()
    assert "does not match its checksum" in capsys.readouterr().err
    write_cached(path, b'{"a": 1}')
    path.write_bytes(b'{"a": 2}')  # edited, same length
    assert read_cached(path) is None
    path.write_bytes(b'{"a": 1}')  # no checksum beside it
    assert read_cached(path) is None and "has no checksum" in capsys.readouterr().err
    assert read_cached(tmp_path / "missing") is None
    assert not list(tmp_path.rglob("*.tmp"))


def test_cached_arrays_are_views_of_the_checked_file_equal_to_np_load(tmp_path, capsys):
    import io

    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "i8": np.array([-1, 2], np.int8),
        "scalar": np.array(1.5),
        "fortran": np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)),
        "empty": np.zeros((0, 5), np.int64),
    }
    for name, save in (("plain", np.savez), ("zipped", np.savez_compressed)):
        buf = io.BytesIO()
        save(buf, **arrays)
        path = tmp_path / f"{name}.npz"
        write_cached(path, buf.getvalue())
        got = read_cached_arrays(path)
        assert sorted(got) == sorted(arrays)
        for k, a in arrays.items():
            assert got[k].dtype == a.dtype and got[k].shape == a.shape and np.array_equal(got[k], a), (name, k)
        assert got["f32"].flags.writeable is (name == "zipped")  # stored members are views of the mapped file
    path = tmp_path / "plain.npz"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # one bit flipped
    path.write_bytes(bytes(data))
    assert read_cached_arrays(path) is None and not path.exists()
    assert "does not match its checksum" in capsys.readouterr().err
    assert read_cached_arrays(tmp_path / "missing.npz") is None


def test_truncated_baseline_cache_is_recomputed_not_used(base_art, calib_arts, tmp_path, capsys):
    from qgate.engines.runners import TorchRunner
    from qgate.gates.shadow import ShadowConfig, baseline_reference

    cfg = ShadowConfig(max_new_tokens=4, max_prompt_tokens=32, max_prompts=4)
    factory = lambda: TorchRunner(base_art.path)  # noqa: E731
    first, hit = baseline_reference(factory, base_art, calib_arts["shadow"], cfg, tmp_path)
    assert not hit
    again, hit = baseline_reference(factory, base_art, calib_arts["shadow"], cfg, tmp_path)
    assert hit and np.array_equal(first["top_lp"], again["top_lp"])
    (npz,) = tmp_path.glob("shadow-baseline-*.npz")
    npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    fresh, hit = baseline_reference(factory, base_art, calib_arts["shadow"], cfg, tmp_path)
    assert not hit and np.array_equal(first["tokens"], fresh["tokens"])
    np.testing.assert_allclose(first["top_lp"], fresh["top_lp"], atol=1e-5)
    assert "recomputing" in capsys.readouterr().err
