-- MLflow's tracking database and its basic-auth user store, beside Prefect's (POSTGRES_DB).
CREATE DATABASE mlflow;
CREATE DATABASE mlflow_auth;
