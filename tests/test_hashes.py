"""pHash12, the colour hash and Hamming helpers: what makes two pictures near duplicates."""

import io

import numpy as np
from PIL import Image, ImageOps
from samples import scene

from assets.decode import decode_views, measure
from assets.hashes import PHASH_BYTES, colorhash64, hamming, hamming_rows, mirror_phash, phash12, to_words


def jpeg(im: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def hashes_of(data: bytes) -> tuple[bytes, bytes]:
    m = measure(data, 1, 1, 0, decode_size=256, stats_size=128)
    return m.phash, m.colorhash


def test_phash12_is_144_bits_half_of_them_set():
    h = phash12(np.asarray(scene(0).convert("L").resize((48, 48))))
    assert len(h) == PHASH_BYTES == 18
    assert 60 <= np.unpackbits(np.frombuffer(h, np.uint8)).sum() <= 84  # median threshold


def test_recompressed_and_resized_copies_stay_close_other_pictures_do_not():
    p0, c0 = hashes_of(jpeg(scene(0), 95))
    p_small, c_small = hashes_of(jpeg(scene(0).resize((110, 110), Image.Resampling.LANCZOS), 40))
    p_other, _ = hashes_of(jpeg(scene(1), 95))
    assert hamming(p0, p_small) <= 12 and hamming(c0, c_small) <= 2
    assert hamming(p0, p_other) > 36


def test_colour_hash_separates_a_hue_shifted_variant_but_not_a_recompressed_copy():
    _, c0 = hashes_of(jpeg(scene(2)))
    _, c_copy = hashes_of(jpeg(scene(2), quality=50))
    _, c_var = hashes_of(jpeg(scene(2, hue_shift=96)))
    assert hamming(c0, c_copy) <= 2
    assert hamming(c0, c_var) >= 12


def test_colour_hash_of_a_flat_colour_is_one_full_cell():
    hsv = np.asarray(Image.new("RGB", (32, 32), (255, 128, 0)).convert("HSV"))
    bits = np.unpackbits(np.frombuffer(colorhash64(hsv), np.uint8)).reshape(8, 8)
    levels = sorted(bits.sum(axis=1).tolist())
    assert levels[-1] == 8 and levels[-2] <= 1  # one full cell; at most a trace of rounding elsewhere


def test_hamming_rows_matches_bytewise_hamming():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 256, (50, 18), dtype=np.uint8), rng.integers(0, 256, (50, 18), dtype=np.uint8)
    expected = [hamming(x.tobytes(), y.tobytes()) for x, y in zip(a, b)]
    assert hamming_rows(to_words(a, 18), to_words(b, 18)).tolist() == expected


def test_exif_rotation_is_undone_before_hashing():
    im = scene(3)
    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned; viewers rotate 270 to show it upright
    im.transpose(Image.Transpose.ROTATE_90).save(buf, "JPEG", quality=95, exif=exif.tobytes())
    upright_hash = measure(jpeg(im, 95), 160, 160, 0, 256, 128).phash
    rotated_hash = measure(buf.getvalue(), 160, 160, 6, 256, 128).phash
    assert hamming(upright_hash, rotated_hash) <= 8


def test_large_jpegs_are_decoded_reduced():
    big = scene(4, size=1024)
    views = decode_views(jpeg(big), 0, decode_size=256, stats_size=128)
    assert views.stats.shape == (128, 128, 3) and views.hash.shape == (48, 48, 3)


def test_mirror_phash_predicts_the_hash_of_a_flipped_copy():
    for seed in range(6):
        im = scene(seed, 200)
        p0, c0 = hashes_of(jpeg(im, 95))
        p_flip, c_flip = hashes_of(jpeg(ImageOps.mirror(im), 95))
        assert hamming(p0, p_flip) > 36  # the plain pHash does not see the copy
        assert hamming(mirror_phash(p0), p_flip) <= 10 and hamming(c0, c_flip) <= 2
        assert mirror_phash(mirror_phash(p0)) == p0
    rows = np.frombuffer(p0 + p_flip, np.uint8).reshape(2, PHASH_BYTES)
    assert mirror_phash(rows)[1].tobytes() == mirror_phash(p_flip)  # rows of an array, as the dedup stage uses it
