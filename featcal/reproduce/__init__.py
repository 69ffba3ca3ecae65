"""Reproducing the FeatCal paper's tables: their published figures as data, a run of their rows on a
zoo, and our figures beside theirs (``featcal reproduce``, :mod:`featcal.cli.reproduce`).

- :mod:`~featcal.reproduce.tables`: the paper's tables (``paper_tables.json``), read and checked;
- :mod:`~featcal.reproduce.setting`: whether a zoo is a table's setting, told before loading it;
- :mod:`~featcal.reproduce.plan`: each row as a featcal method, and its forward passes;
- :mod:`~featcal.reproduce.estimate`: time (from passes timed on the zoo) and memory, up front;
- :mod:`~featcal.reproduce.run`: merging, calibrating and scoring the rows;
- :mod:`~featcal.reproduce.report`: ours | paper | diff, as markdown and records.
"""
