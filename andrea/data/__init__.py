"""Data stages of ANDREA: the embedded corpus, the Hermes-3 pull, the megachat merge, the chat template.

    andrea build-embedded --out data/embedded
    andrea pull-hermes3 -S hermes3.source=embedded --embedded data/embedded --out data/raw/hermes3/embedded
    andrea prep-megachat -S hermes3.source=embedded --raw data/raw/hermes3/embedded --embedded data/embedded \\
        --out data/megachat/embedded

Modules: ``embedded`` (build-embedded), ``hermes3`` (pull-hermes3), ``megachat`` (prep-megachat),
``template`` (the one chat template and the shape checks).
"""
