"""A rank-file worker process (``python -m``; :mod:`.workers`): reads the ranks it is sent, answers plain data."""

if __name__ == "__main__":
    from . import read_for_worker
    from .workers import serve

    serve(read_for_worker)
