"""`streambox paper FIGURE`: the paper's evaluation figures (ATC'24 section 9), ours beside the paper's.

    streambox paper 12 13 14 --out runs/paper      # one replay comparison shared by the three
    streambox paper all --quick                    # every figure, CI-sized

Each figure writes out/figNN/{table.md, table.json, *.png}; every number of a table names the file of
this run it was read from (`table.check_rows` verifies them). The paper's numbers live in `numbers`.
"""
