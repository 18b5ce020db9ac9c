"""Developer tools, apart from the library (nothing in ds_q8 imports them): ``python -m ds_q8.tools.bench``
times steps and (de)quantization (``bench_rows``: its rows and tables), ``python -m ds_q8.tools.soak`` runs
many small steps watching memory and kernel-against-reference drift."""
