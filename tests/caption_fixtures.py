"""Tiny, randomly initialised generators for the caption tests: a word-level tokenizer built offline, a
LLaVA-style VLM (CLIP vision tower + Llama) and a Llama causal LM, saved with save_pretrained so the
product loads them back through its own from_pretrained path."""

from __future__ import annotations

from pathlib import Path

WORDS = (  # yes / no: the VLM labeller's answer words
    "a an the of on in with and red green blue yellow white black orange purple pink grey circle square triangle diamond sign word "
    "text background small large two three left right top bottom center striped gradient sale stop open kiln cafe exit hello pizza "
    "books hotel image shows describe detail short tags json caption yes no"
).split()
SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]


def write_tokenizer(d: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tok.add_tokens(["<image>"], special_tokens=True)  # one token, never split by the pre-tokenizer
    tok.save_pretrained(str(d))
    return tok


def _llama(vocab: int, tok, hidden: int = 32):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )


def write_tiny_causal_lm(directory: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(d)
    torch.manual_seed(seed)
    LlamaForCausalLM(_llama(len(tok), tok)).eval().save_pretrained(str(d))
    return d


def write_tiny_vlm(directory: str | Path, seed: int = 0, image_size: int = 32, patch: int = 8) -> Path:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(d)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_llama(len(tok), tok),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    images = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    ).save_pretrained(str(d))
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).eval().save_pretrained(str(d))
    return d


def scene_image(directory: Path, name: str, scene_json: str, width: int = 112, height: int = 104) -> Path:
    """One demo scene drawn to a PNG (components.demo_scenes), e.g. a sign with a word on it."""
    from components.demo_scenes import Scene, render

    path = Path(directory) / f"{name}.png"
    render(Scene.from_json(scene_json), width, height).save(path, format="PNG")
    return path


def sign(word: str, color: str = "red", background: str = "blue", seed: int = 3) -> str:
    import json

    return json.dumps(
        {
            "family": "text_sign",
            "background": {"color": background, "pattern": "plain", "color2": None},
            "shapes": [],
            "text": word,
            "sign_color": color,
            "layout_seed": seed,
        }
    )


def shape(shape_name: str = "circle", color: str = "yellow", background: str = "blue", seed: int = 5) -> str:
    import json

    return json.dumps(
        {
            "family": "single_shape",
            "background": {"color": background, "pattern": "plain", "color2": None},
            "shapes": [{"color": color, "shape": shape_name, "size": "large", "position": "center", "count": 1}],
            "text": None,
            "sign_color": None,
            "layout_seed": seed,
        }
    )


def deduped_rows(paths: list[Path]):
    """DEDUPED rows for image files, with plausible filter statistics (the stages before are not needed here)."""
    import hashlib

    import pyarrow as pa
    from PIL import Image

    from kiln.schemas import DEDUPED

    rows = []
    for p in paths:
        data = Path(p).read_bytes()
        try:
            w, h = Image.open(p).size
        except OSError:  # a broken file: the stage under test must reject it
            w, h = 0, 0
        id_ = hashlib.sha1(str(p).encode()).hexdigest()[:16]
        rows.append(
            {
                "id": id_,
                "uri": str(p),
                "bytes": len(data),
                "md5": hashlib.md5(data).hexdigest(),
                "format": "PNG",
                "width": w,
                "height": h,
                "mode": "RGB",
                "exif_orientation": 1,
                "n_frames": 1,
                "aspect": max(w, h) / max(1, min(w, h)),
                "laplacian_var": 300.0,
                "entropy": 5.5,
                "white_ratio": 0.0,
                "black_ratio": 0.0,
                "border_share": 0.0,
                "flat_share": 0.2,
                "phash": bytes(18),
                "colorhash": bytes(8),
                "dup_group": id_,
            }
        )
    return pa.Table.from_pylist(rows, schema=DEDUPED)


def ocred_rows(deduped, texts: list[str], heights: list[float] | None = None):
    """OCRED rows from DEDUPED ones with given OCR text (for caption / rewrite tests that need no OCR run)."""
    import json

    import pyarrow as pa

    from kiln.schemas import OCRED

    heights = heights or [20.0 if t else 0.0 for t in texts]
    extra = {
        "ocr_text": texts,
        "ocr_boxes": [json.dumps([[10, 10, 60, 10 + h, t, 0.99]] if t else []) for t, h in zip(texts, heights)],
        "ocr_engine": ["rapidocr"] * len(texts),
        "contains_text": [bool(t) for t in texts],
        "text_area_share": [0.1 if t else 0.0 for t in texts],
        "text_density": [1.0 if t else 0.0 for t in texts],
        "text_complexity": [2.0 if t else 0.0 for t in texts],
        "min_text_height": heights,
    }
    t = deduped
    for k, v in extra.items():
        t = t.append_column(k, pa.array(v))
    return t.cast(OCRED)
