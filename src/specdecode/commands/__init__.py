"""The command line, ``specdecode <command>``: every argparse parser and command function.

One module per command (:mod:`~specdecode.commands.generate`, :mod:`~specdecode.commands.prepare`,
:mod:`~specdecode.commands.bench`, :mod:`~specdecode.commands.serve`,
:mod:`~specdecode.commands.token_map`, :mod:`~specdecode.commands.calibrate_early_exit`,
:mod:`~specdecode.commands.train_drafter`), the arguments they share in
:mod:`~specdecode.commands.common`, and the top-level parser and ``main`` (the console script) in
:mod:`~specdecode.commands.main`.

The library never imports this package (tests/test_imports.py): the commands configure the
library, not the other way round. Building the parser imports the library modules whose defaults the
options show (torch with them); models, FastAPI, uvicorn and matplotlib load only inside a command.
"""
