"""Process defaults applied before Prefect or MLflow are imported."""
import os


def apply_defaults() -> None:
    home = os.path.abspath(os.environ.setdefault("POSTTRAIN_HOME", ".posttrain"))
    os.environ.setdefault("PREFECT_HOME", os.path.join(home, "prefect"))
    os.makedirs(os.environ["PREFECT_HOME"], exist_ok=True)  # Prefect's SQLite needs the directory
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # the ephemeral API server starts slowly on 2 busy cores (default timeout 20 s)
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    # tasks/ log to standard `posttrain.*` loggers (Prefect stays in flows/); inside a flow run
    # Prefect sends their records to the run's log in the UI as well
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "posttrain")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
