"""Write the embedded default model into sgl_kara/assets/default_model (a few MB, seeded).

For now a random-weight Llama with a real byte-level BPE tokenizer; a later issue replaces it
with the trained reasoning proxy. Run: python scripts/make_default_model.py
"""

import shutil

from sgl_kara.default_model import DEFAULT_MODEL_DIR
from sgl_kara.models.tiny import write_tiny_model

if __name__ == "__main__":
    shutil.rmtree(DEFAULT_MODEL_DIR, ignore_errors=True)
    write_tiny_model(
        DEFAULT_MODEL_DIR, "llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=256, vocab_size=512, seed=2026,
    )
    print("wrote", DEFAULT_MODEL_DIR)
