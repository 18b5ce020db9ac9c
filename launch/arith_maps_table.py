"""Markdown summary of launch/results/maps/arith_*.json: per variant and setting, the lowest and median
per-matrix update cosine against torch's AdamW, and the maps' ranges (arith_map_table.json).

    python launch/arith_maps_table.py > launch/results/maps/arith_maps.md
"""
import glob
import json
import os

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "maps")
#: lowest per-matrix cosine of the shipped optimizers in the same settings (ds_q8 default, bitsandbytes)
KNOWN = {(768, 0): (0.99953, 0.99921), (768, 10): (0.99887, 0.99825), (1600, 0): (0.99962, 0.99864)}


def main() -> None:
    rows = []
    for path in sorted(glob.glob(os.path.join(HERE, "arith_[0-9]*.json"))):
        rows += json.load(open(path))
    print("| setting | m map | v map | bits seed | lowest cosine (matrix) | median cosine | target met |")
    print("|---|---|---|---:|---:|---:|---|")
    for r in sorted(rows, key=lambda r: (r["width"], r["warmup"], r["m_map"] != "dyn6" or r["v_map"] != "dyn",
                                         r.get("bits_seed") or 0, r["optimizer"])):
        ds, bnb = KNOWN[(r["width"], r["warmup"])]
        target = r["min_cosine"] > bnb and (r["width"] != 768 or r["warmup"] or r["min_cosine"] >= 0.9995)
        setting = f"{r['width']} ({r['layers']} layers){' warm-up ' + str(r['warmup']) if r['warmup'] else ''}"
        print(f"| {setting} | {r['m_map']} | {r['v_map']} | {r.get('bits_seed') or 0} | {r['min_cosine']:.5f} "
              f"(`{r['worst_matrix'].replace('transformer.', '')}`) | {r['median_cosine']:.5f} | "
              f"{'yes' if target else 'no'} |")
    print("\n| map | moment | smallest positive | decades | distinct values | positive entries per binade, top 4 |")
    print("|---|---|---:|---:|---:|---|")
    for d in json.load(open(os.path.join(HERE, "arith_map_table.json"))):
        print(f"| {d['map']} | {d['moment']} | {d['smallest']:.3g} | {d['decades']} | {d['distinct']} | "
              + " / ".join(str(k) for k in d["per_binade_top4"]) + " |")


if __name__ == "__main__":
    main()
