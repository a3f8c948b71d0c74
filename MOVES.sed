# models/ regrouped (branch house-models): old module -> new module, for GNU sed -i -f MOVES.sed FILES.
# Each rule is guarded so that attribute chains such as `service.models.registry` (app/engine's routing table)
# and already-moved paths (`models.export.compile`) are left alone; applying the script twice changes nothing.
#
# Whole-module moves (every name kept its name):
#   models.registry      -> models.architectures       (ARCHS, build_model, head_of)
#   models.folder        -> models.data.folder
#   models.loaders       -> models.data.loaders
#   models.augment       -> models.data.augment
#   models.gpu_data      -> models.data.gpu
#   models.jpeg          -> models.data.jpeg
#   models.manifest      -> models.export.manifest
#   models.repository    -> models.export.repository
#   models.compile       -> models.export.compile
#   models.torchscript   -> models.export.torchscript  (also gained to_torchscript, check_same_outputs: see below)
#   models.train_args    -> models.run.args
#   models.amp           -> models.run.amp
#   models.optim         -> models.run.optim
#   models.distributed   -> models.run.distributed
#   models.checkpoint    -> models.run.checkpoint
#   models.photo_dataset -> demo_data.photos
#   (models.folder.DataError -> models.run.args.DataError: the one name that left models.folder)
# Merged or split modules (names that moved, by name):
#   models.resume.checkpoint_state, start_or_resume        -> models.run.checkpoint
#       checkpoint_state(..., args, data, preset, metrics) now takes `classes` (data.classes) instead of `data`
#   models.runlog.RunLog, read_metrics, METRICS_NAME       -> models.run.report
#   models.progress.Progress, duration, Timer, TOP5_MIN_CLASSES -> models.run.report
#   models.progress.confusion, confusion_counts, write_confusion, CONFUSION_NAME -> models.run.confusion
#   models.progress.AsyncScalar, peak_memory, reset_peak_memory -> models.run.device_stats
#   models.progress.interrupted                            -> models.run.checkpoint
#   models.export (module) -> package models/export/:
#       export_model, export_default, export_checkpoint, check_replace, weights_digest, default_version,
#       TORCHSCRIPT_NAME, STATE_DICT_NAME, PACKAGE_MAX_BATCH  -> models.export.write
#       to_torchscript, _check_same_outputs (now check_same_outputs) -> models.export.torchscript
#       main, get_args_parser, package_targets             -> models.export.__main__
#       `python -m models.export ...` is unchanged (models/export/__main__.py)
#   models.datasets (module) -> top-level package demo_data/:
#       write_digits, write_textures                       -> demo_data.small_sets
#       main, WRITERS                                      -> demo_data.__main__
#       `python -m models.datasets NAME ...`               -> `python -m demo_data NAME ...`
# The server may import only models.__init__.SERVING_CONTRACT (tests/test_house.py).

# (tests/test_training_parts.py: the two `from models.run.report import` lines these rules leave were joined by
# hand into one.)
# --- split modules: import lines, by the names they import (before the whole-module rules) ---
s/from models\.export import main\b/from models.export.__main__ import main/g
s/from models\.export import package_targets\b/from models.export.__main__ import package_targets/g
s/from models\.export import get_args_parser\b/from models.export.__main__ import get_args_parser/g
s/from models\.export import \(export_\|check_replace\|weights_digest\|default_version\|TORCHSCRIPT_NAME\|STATE_DICT_NAME\|PACKAGE_MAX_BATCH\)/from models.export.write import \1/g
s/from models\.export import to_torchscript\b/from models.export.torchscript import to_torchscript/g
s/from models\.datasets import \(write_\)/from demo_data.small_sets import \1/g
s/from models\.datasets import \(main\|WRITERS\)\b/from demo_data.__main__ import \1/g
s/^\(\s*\)from models\.progress import AsyncScalar, Progress, peak_memory$/\1from models.run.device_stats import AsyncScalar, peak_memory\n\1from models.run.report import Progress/
s/from models\.progress import \(confusion\|write_confusion\|CONFUSION_NAME\)/from models.run.confusion import \1/g
s/from models\.progress import \(AsyncScalar\|peak_memory\|reset_peak_memory\)/from models.run.device_stats import \1/g
s/from models\.progress import \(interrupted\)\b/from models.run.checkpoint import \1/g
s/from models\.progress import \(Progress\|Timer\|duration\|TOP5_MIN_CLASSES\)/from models.run.report import \1/g
s/models\.datasets' /demo_data's /g
s/from models import checkpoint as ckpt/from models.run import checkpoint as ckpt/g
s/models\.export\.\(export_model\|export_default\|export_checkpoint\)\b/models.export.write.\1/g
s/models\.export\.\(package_targets\|get_args_parser\)\b/models.export.__main__.\1/g

# --- dotted module paths (imports, -m, monkeypatch targets, logger names, docs) ---
s/\(^\|[^.[:alnum:]_]\)models\.train_args\b/\1models.run.args/g
s/\(^\|[^.[:alnum:]_]\)models\.photo_dataset\b/\1demo_data.photos/g
s/\(^\|[^.[:alnum:]_]\)models\.torchscript\b/\1models.export.torchscript/g
s/\(^\|[^.[:alnum:]_]\)models\.distributed\b/\1models.run.distributed/g
s/\(^\|[^.[:alnum:]_]\)models\.repository\b/\1models.export.repository/g
s/\(^\|[^.[:alnum:]_]\)models\.checkpoint\b/\1models.run.checkpoint/g
s/\(^\|[^.[:alnum:]_]\)models\.registry\b/\1models.architectures/g
s/\(^\|[^.[:alnum:]_]\)models\.manifest\b/\1models.export.manifest/g
s/\(^\|[^.[:alnum:]_]\)models\.gpu_data\b/\1models.data.gpu/g
s/\(^\|[^.[:alnum:]_]\)models\.datasets\b/\1demo_data/g
s/\(^\|[^.[:alnum:]_]\)models\.progress\b/\1models.run.report/g
s/\(^\|[^.[:alnum:]_]\)models\.compile\b/\1models.export.compile/g
s/\(^\|[^.[:alnum:]_]\)models\.loaders\b/\1models.data.loaders/g
s/\(^\|[^.[:alnum:]_]\)models\.augment\b/\1models.data.augment/g
s/\(^\|[^.[:alnum:]_]\)models\.runlog\b/\1models.run.report/g
s/\(^\|[^.[:alnum:]_]\)models\.resume\b/\1models.run.checkpoint/g
s/\(^\|[^.[:alnum:]_]\)models\.folder\b/\1models.data.folder/g
s/\(^\|[^.[:alnum:]_]\)models\.optim\b/\1models.run.optim/g
s/\(^\|[^.[:alnum:]_]\)models\.jpeg\b/\1models.data.jpeg/g
s/\(^\|[^.[:alnum:]_]\)models\.amp\b/\1models.run.amp/g

# --- file paths (docs, docstrings, comments) ---
s/\(^\|[^/[:alnum:]_.]\)models\/train_args\.py/\1models\/run\/args.py/g
s/\(^\|[^/[:alnum:]_.]\)models\/photo_dataset\.py/\1demo_data\/photos.py/g
s/\(^\|[^/[:alnum:]_.]\)models\/torchscript\b/\1models\/export\/torchscript/g
s/\(^\|[^/[:alnum:]_.]\)models\/distributed\b/\1models\/run\/distributed/g
s/\(^\|[^/[:alnum:]_.]\)models\/repository\.py/\1models\/export\/repository.py/g
s/\(^\|[^/[:alnum:]_.]\)models\/checkpoint\b/\1models\/run\/checkpoint/g
s/\(^\|[^/[:alnum:]_.]\)models\/registry\b/\1models\/architectures/g
s/\(^\|[^/[:alnum:]_.]\)models\/manifest\b/\1models\/export\/manifest/g
s/\(^\|[^/[:alnum:]_.]\)models\/gpu_data\b/\1models\/data\/gpu/g
s/\(^\|[^/[:alnum:]_.]\)models\/datasets\.py/\1demo_data\/small_sets.py/g
s/\(^\|[^/[:alnum:]_.]\)models\/progress\.py/\1models\/run\/report.py/g
s/\(^\|[^/[:alnum:]_.]\)models\/compile\b/\1models\/export\/compile/g
s/\(^\|[^/[:alnum:]_.]\)models\/loaders\b/\1models\/data\/loaders/g
s/\(^\|[^/[:alnum:]_.]\)models\/augment\b/\1models\/data\/augment/g
s/\(^\|[^/[:alnum:]_.]\)models\/runlog\b/\1models\/run\/report/g
s/\(^\|[^/[:alnum:]_.]\)models\/resume\b/\1models\/run\/checkpoint/g
s/\(^\|[^/[:alnum:]_.]\)models\/folder\b/\1models\/data\/folder/g
s/\(^\|[^/[:alnum:]_.]\)models\/optim\b/\1models\/run\/optim/g
s/\(^\|[^/[:alnum:]_.]\)models\/jpeg\b/\1models\/data\/jpeg/g
s/\(^\|[^/[:alnum:]_.]\)models\/amp\b/\1models\/run\/amp/g
s/\(^\|[^/[:alnum:]_.]\)models\/export\.py/\1models\/export\/write.py/g

# DataError moved from models.folder to models.run.args (the run's user-input error; no one outside models/ imports it)
s/from models\.data\.folder import DataError$/from models.run.args import DataError/
