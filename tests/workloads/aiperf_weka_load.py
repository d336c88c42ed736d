"""Load a Weka/AgentX trace with AIPerf's own loader; print what it built, as one JSON line.

Run with the AIPerf venv's interpreter (scripts/install-aiperf.sh), never imported by pytest:
    .venv-aiperf/bin/python tests/workloads/aiperf_weka_load.py TRACE_DIR

AIPerf renders every hash block through a tokenizer; a word-level one is built here from the
`tokenizers` package AIPerf depends on, so nothing is downloaded. The loader's checks (a turn-0
system + tools prefix covered by hash ids, blocks tiling each prompt) do not depend on which
tokenizer renders the blocks.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def word_level_tokenizer(folder: Path) -> str:
    """A 4,000-word tokenizer saved as a transformers tokenizer dir; returns the dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1} | {f"w{i}": i for i in range(2, 4000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    fast.save_pretrained(folder)
    return str(folder)


def main(trace: str) -> None:
    from aiperf.common import random_generator
    from aiperf.common.tokenizer import Tokenizer
    from aiperf.dataset.generator.prompt import PromptGenerator
    from aiperf.dataset.loader.weka_trace import WekaTraceLoader

    random_generator.init(42)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Tokenizer.from_pretrained(word_level_tokenizer(Path(tmp)), resolve_alias=False)
    prompts = PromptGenerator(prompts=None, prefix_prompts=None, tokenizer=tokenizer)
    loader = WekaTraceLoader(filename=trace, prompt_generator=prompts)
    traces = loader.load_dataset()
    conversations = loader.convert_to_conversations(traces)
    turns = [turn for c in conversations for turn in c.turns]
    print(
        json.dumps(
            {
                "traces": sorted(traces),
                "conversations": len(conversations),
                "turns": len(turns),
                "max_tokens": sum(t.max_tokens or 0 for t in turns),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
