"""Reading a run: the audit (``audit.py``), the eval (``evaluate.py``) with its external judge
client (``judge.py``), self-contained HTML/Markdown rendering with inline SVG figures
(``render.py``) and the live loss dashboard (``dashboard.py``).

    andrea audit --profile tiny --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json --out reports/tiny
    andrea eval  --profile tiny --run runs/tiny/main --tokenizer data/tokenizer/tiny/tokenizer.json \\
                 --tokens data/tokens/tiny --audit reports/tiny/audit.json --out reports/tiny
    andrea dashboard runs/tiny/main --port 8765
"""
